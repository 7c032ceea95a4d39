"""What a site admin learns before spending any budget: the data check and the signal check."""
