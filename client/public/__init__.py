"""Choices made on public data at no privacy cost: heads, clip norm, centre and scope."""
