"""The evaluation library (imports nothing on import): ``decode`` (translate text, the decoding options),
``scores`` (validation loss, BLEU/chrF of a split, the scoring protocol), ``load`` (a model from a checkpoint).
The engine's epoch end and the commands (``fastmt translate``/``evaluate``/``export``) use it; it imports no command.
"""
