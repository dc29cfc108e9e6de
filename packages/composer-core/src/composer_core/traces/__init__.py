"""The trace pipeline: agent episodes → teacher replay → preference pairs → training records → batches (the
modules: the package README's "Traces, hints and teacher replay"). The loss math never imports it.
"""

from composer_core.traces.schema import *  # noqa: F403  (the episode schema is this package's vocabulary)
from composer_core.traces.schema import __all__ as __all__
