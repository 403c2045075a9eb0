"""The operator's queries: status reports, requeue and cancel, retention of finished rows."""
