"""dpmtv package."""
