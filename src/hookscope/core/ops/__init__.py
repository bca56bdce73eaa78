"""Operation sites: what a selector ``"layer::op"`` names and how hookscope sees the calls.

``_select``: the vocabulary (operation names, parsing a selector, how an operation's
arguments are named); ``_watch``: the function mode pushed while a selected module's call
runs and the owner of each intercepted call, found on the Python stack; ``_attention``: the
attention weights of fused ``scaled_dot_product_attention`` calls. A session follows
operation sites through ``Session._watch_ops`` (``core/_session.py``); what a capture and an
edit do at a site are their own methods (``_capture.py``, ``_editor.py``).

This package's ``__init__`` imports nothing, so that ``core/_naming.py`` can use the
vocabulary without importing the machinery.
"""
