"""Ways to get a kernel: the fork server, the jupyter_client provisioner, the warm pool and the
Enterprise Gateway launcher."""
