"""Answering queries with a model, patched with a released task vector where one is used."""
