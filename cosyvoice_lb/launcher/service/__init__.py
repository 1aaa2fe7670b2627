"""Starting the cluster at boot: a systemd unit that runs `up --foreground`."""
