"""Export: a sink folder in the shapes trainers load as they are (Hugging Face datasets, speculators, SpecForge)."""
