"""Text task kits. `classification`: data files, `datasets` names and the embedded tweet corpus, label encoding,
tokenization and padding statistics for sequence classification (the nlp_finetune recipe)."""
