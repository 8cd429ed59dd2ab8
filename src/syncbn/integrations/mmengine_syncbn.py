"""Importing this module registers syncbn's names and makes OpenMMLab configs' ``"SyncBN"`` build
:class:`syncbn.SyncBatchNorm` (:func:`syncbn.integrations.mmengine.replace_syncbn`), for configs that
should not be edited otherwise::

    custom_imports = dict(imports=["syncbn.integrations.mmengine_syncbn"], allow_failed_imports=False)
"""

from __future__ import annotations

from .mmengine import replace_syncbn

replace_syncbn()
