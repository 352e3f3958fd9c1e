"""The MLflow experiment opens on its training runs: MLflow 3's UI chooses the page by the
experiment's ``mlflow.experimentKind`` tag (without it, a new experiment opens on the GenAI
overview), set when the experiment is made and added to one made before the tag."""
from __future__ import annotations

from mlflow.tracking import MlflowClient

from stages.mechanism import tracking


def test_new_and_older_experiments_are_training_experiments(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    made = tracking.ensure_experiment(uri, "new", tmp_path)
    older = MlflowClient(uri).create_experiment("older")  # as made before the tag
    assert tracking.ensure_experiment(uri, "older", tmp_path) == older
    for experiment_id in (made, older):
        tags = MlflowClient(uri).get_experiment(experiment_id).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development"
