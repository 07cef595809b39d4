"""Text task kits, one sub-package each. `classification`: data files, `datasets` names and the embedded tweet
corpus, label encoding, tokenization and padding statistics for sequence classification (the nlp_finetune recipe).
`generation`: source -> target pairs, prompt/completion, chats and language-modelling blocks, their tokens and
collators, seq2seq and causal models (pretrained, from a config, warm-started from an encoder, LoRA), generation
gathered once per item across processes, and ROUGE / BLEU / exact-match scoring (the text_generation recipe)."""
