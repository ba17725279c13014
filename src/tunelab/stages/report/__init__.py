"""Stage 13, report: the dossier, built only from the study's records (`stage.run`)."""
