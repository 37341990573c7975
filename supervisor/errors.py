"""Errors a control-socket request can meet; control.py maps them to HTTP statuses."""


class Conflict(Exception):
    """The request contradicts the daemon's state (a stale round or version): HTTP 409."""


class BadRequest(Exception):
    """The request is wrong in itself (a checkpoint that does not exist): HTTP 400."""
