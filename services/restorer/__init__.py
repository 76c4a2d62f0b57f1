"""The restorer: consumes restore.requested.<node>.<ns>, fetches and verifies a
generation, restores it with CRIU, answers with restore.done."""
