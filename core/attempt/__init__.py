"""One attempt at delivering or handling an event, shared by the dispatcher, the producer and
the consumer: its failure vocabulary (:mod:`.failure`) and when it is tried again
(:mod:`.retry`). Each of them classifies, redacts and shortens errors here, never itself."""
