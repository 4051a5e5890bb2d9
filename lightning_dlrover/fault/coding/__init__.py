"""Erasure coding of the embedding state: a rank's state as byte chunks (:mod:`.coded_state`) and its undo log
(:mod:`.undo_log`), where parity lives (:mod:`.placement`), the per-step delta exchange (:mod:`.messages`), the
coded embeddings and their commit (:mod:`.coded_embeddings`), and decoding lost ranks (:mod:`.decode`)."""
