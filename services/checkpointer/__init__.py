"""The checkpointer: consumes ckpt.requested.<node>, dumps the target with
CRIU, commits the images as a new generation, answers with ckpt.done."""
