"""Everything room-outbox keeps in its database, by concept.

* :mod:`.protocol`: the store's protocols and records (imports no driver);
* :mod:`.factory`: opens the store a DSN names (the one module importing every backend);
* :mod:`.backends`: MySQL/MariaDB, PostgreSQL and SQLite, their drivers and errors, and the
  claim SQL the three share (:mod:`.backends.leased`);
* :mod:`.schema`: the tables, their migration plans and the start-up check;
* :mod:`.lanes`: the lanes besides IM, each in a table of its own;
* :mod:`.consumers`: the consumers' processed records, retries and leases;
* :mod:`.operator`: the operator's queries (status, requeue, cancel) and retention;
* :mod:`.membership`, :mod:`.clock`, :mod:`.dialect`, :mod:`.deadline`, :mod:`.producer`:
  the cluster's tables, the database's clock, what differs between databases, the query
  deadline, the producer's mark.
"""
