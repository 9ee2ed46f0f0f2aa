"""The commands wing: every command and flag people type. ``commands`` (the ``fastmt`` dispatch), ``flags`` (train's
flags, ``--config`` files, the checks before any side effect), ``train``, ``translate``, ``evaluate``, ``stats``,
``model``, ``export``, and ``decoding`` (the decoding flags those share). It sits on top: the engine (``train/``)
and the run wing (``train.runs``) never import it.
"""
