"""The databases the store runs on, each behind its driver, and the SQL the three share."""
