"""streamtally."""
