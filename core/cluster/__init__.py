"""Several ``room-outbox run`` processes as one deployment: who is alive, which rooms each one
serves (:mod:`.membership`) and each one's part of the rate limits they share (:mod:`.quota`)."""
