"""``fastmt export``: a trained checkpoint as a CTranslate2 model (``ct2.py``) or a Hugging Face folder (``hf.py``),
each with a translator object that decodes it under fastmt's decoding rules (``CT2Translator``, ``HFTranslator``).
The command line is ``cli.py``; what both targets read from a checkpoint is ``common.py``."""
