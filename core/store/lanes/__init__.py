"""The lanes besides IM: one table per lane, fed from the outbox table, claimed like it."""
