"""Kubernetes: the manifests ``cosyvoice-lb k8s render`` writes."""
