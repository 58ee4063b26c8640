"""How the built-in default model was made (its folder, ``qjax/assets/default``, is package data found through
:func:`qjax.checkpoint.hub.default_model_dir`): :mod:`.train` trains the model, :mod:`.train_tokenizer` its tokenizer.
"""
