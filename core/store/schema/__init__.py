"""The store's tables: what they hold, how ``migrate`` creates and upgrades them, and the start-up check that they are migrated."""
