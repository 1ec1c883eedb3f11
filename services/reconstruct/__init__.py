"""The reconstruct stage: exact token ids and loss mask of each prompt and its answer."""
