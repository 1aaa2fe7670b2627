"""The running cluster: supervisord, nginx, the lifecycle (up, restart, drain, down), status."""
