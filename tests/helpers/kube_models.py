"""Load a Kubernetes manifest into the Kubeflow SDKs' own models, strictly: every key must be a field of
the model at its place (the SDKs drop unknown keys silently, as a cluster's CRD schema prunes them), and
the values must load into the models' types.

- TrainJob: kubeflow-trainer-api's pydantic models (fields by alias, nested models from the annotations).
- PyTorchJob: kubeflow-training's OpenAPI-generated models (attribute_map and openapi_types, with the
  kubernetes client's models for the pod template).
"""

from __future__ import annotations

import types
import typing
from typing import Any


def unknown_keys(data: Any, model: Any, path: str = "") -> list[str]:
    """Paths of the keys in `data` that `model` (a pydantic model class or an OpenAPI type name of
    kubeflow-training) does not declare, recursively."""
    if isinstance(model, str):
        return _openapi_unknown(data, model, path)
    return _pydantic_unknown(data, model, path)


def _pydantic_unknown(data: Any, model: Any, path: str) -> list[str]:
    from pydantic import BaseModel

    if isinstance(model, type) and issubclass(model, BaseModel):
        if hasattr(model, "one_of_schemas") or not isinstance(data, dict):  # oneOf wrappers hold plain values
            return []
        fields = {(field.alias or name): field.annotation for name, field in model.model_fields.items()}
        found = []
        for key, value in data.items():
            if key not in fields:
                found.append(f"{path}.{key} (not a field of {model.__name__})")
            else:
                found += _pydantic_unknown(value, fields[key], f"{path}.{key}")
        return found
    origin, args = typing.get_origin(model), typing.get_args(model)
    if origin in (typing.Union, types.UnionType):
        nested = [a for a in args if a is not type(None)]
        return _pydantic_unknown(data, nested[0], path) if len(nested) == 1 else []
    if origin is list and isinstance(data, list):
        return [key for i, item in enumerate(data) for key in _pydantic_unknown(item, args[0], f"{path}[{i}]")]
    if origin is dict and isinstance(data, dict):
        return [key for k, v in data.items() for key in _pydantic_unknown(v, args[1], f"{path}[{k}]")]
    return []


def _openapi_unknown(data: Any, type_name: str, path: str) -> list[str]:
    import kubeflow.training.models as models

    if type_name.startswith("list[") and isinstance(data, list):
        return [key for i, item in enumerate(data) for key in _openapi_unknown(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("dict(") and isinstance(data, dict):
        value_type = type_name[5:-1].split(", ", 1)[1]
        return [key for k, v in data.items() for key in _openapi_unknown(v, value_type, f"{path}[{k}]")]
    cls = getattr(models, type_name, None)
    if cls is None or not hasattr(cls, "attribute_map") or not isinstance(data, dict):
        return []  # a primitive (str, int, object, ...)
    attribute_of = {json_key: attribute for attribute, json_key in cls.attribute_map.items()}
    found = []
    for key, value in data.items():
        if key not in attribute_of:
            found.append(f"{path}.{key} (not a field of {type_name})")
        else:
            found += _openapi_unknown(value, cls.openapi_types[attribute_of[key]], f"{path}.{key}")
    return found


def load_trainjob(manifest: dict) -> Any:
    """The TrainJob as kubeflow-trainer-api's model; AssertionError naming any unknown key."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    unknown = unknown_keys(manifest, TrainerV1alpha1TrainJob)
    assert not unknown, f"keys the TrainJob schema does not have: {unknown}"
    return TrainerV1alpha1TrainJob.from_dict(manifest)


def load_pytorchjob(manifest: dict) -> Any:
    """The PyTorchJob as kubeflow-training's model (client-side validation on); AssertionError naming any
    unknown key."""
    from kubeflow.training import ApiClient

    unknown = unknown_keys(manifest, "KubeflowOrgV1PyTorchJob")
    assert not unknown, f"keys the PyTorchJob schema does not have: {unknown}"
    return ApiClient()._ApiClient__deserialize(manifest, "KubeflowOrgV1PyTorchJob")
