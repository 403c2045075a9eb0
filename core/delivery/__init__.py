"""Delivery: what happens around one attempt to hand an event to its sink."""
