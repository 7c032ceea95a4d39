"""A site's side of a release: its record, policy, ledgers and the single-holder release."""
