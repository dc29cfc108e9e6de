"""Example configs shipped with composer-verl (``composer_grpo.yaml``); see the package README."""
