"""placeholder"""
from typing import Any


def add_serve_parser(sub: Any) -> None:
    pass
