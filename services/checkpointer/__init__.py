"""The checkpointer: consumes ckpt.requested.<node>.<ns>, dumps the target with
CRIU, commits the images as a new generation, answers with ckpt.done."""
