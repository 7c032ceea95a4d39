"""The site service and the socket protocol its relays speak.

Import the parts from their modules: ``client.service.wire`` is light (the relay imports it
in every per-message process); ``client.service.server`` loads the site's model and data.
"""
