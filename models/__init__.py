"""Model families, one package each (``llama/``, ...), installed as ``megatron_train.models``.

A family package builds one :class:`~megatron_train.models.family.Family`; ``registry`` maps
family names, presets and Hugging Face architectures to it.
"""
