"""The trace pipeline: agent episodes → teacher replay → preference pairs → training records → batches.

``schema`` (typed OpenAI-format episodes, ingesters, error sites), ``hints`` (hinted teacher contexts and SDPO
token masks), ``replay`` + ``replay_cli`` (``composer-replay``: N teachers re-act at the student's error sites),
``pairs`` (pairs where a teacher beat the student), ``records`` (the training-record schema), ``sdpo_batch`` /
``pair_batch`` (collation into channel-2 / channel-3 tensors) and ``datajuicer`` (py-data-juicer filters).
The loss math never imports this package, and it imports none of the loss math.
"""

from composer_core.traces.schema import *  # noqa: F403  (the episode schema is this package's vocabulary)
from composer_core.traces.schema import __all__ as __all__
