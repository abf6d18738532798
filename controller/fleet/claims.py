"""A new owner's first word on a key: a `claim` at its epoch, and the log read up to it.

When this replica starts to hold a key (a new `Ownership.tenure`), it publishes a `claim`
control at its epoch before anything else. Engines take the epoch from it and refuse what
an older epoch sends after it, so a previous owner that has not noticed it lost the key
(stopped, partitioned) cannot move them: the fencing token is on the log the engines read,
not only in the coordinator. The key's loop starts only once the tables topic has been read
up to the claim: all the previous owner got onto the log before it is known (its newest
version, so none is reused; its operators' pins), and all after it is fenced.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controller.fleet.ownership import Ownership
from schemas import TableControl, TableKey
from schemas.control import new_control_id


@dataclass
class _Claim:
    tenure: int
    control_id: str
    read_back: bool = False
    """The tables topic has been read up to the claim: the key's state is complete."""
    superseded: bool = False
    """A newer epoch claimed the key: this replica lost it and has not been told yet."""


class KeyClaims:
    def __init__(self, ownership: Ownership, send: Callable[[TableControl], None],
                 issued_by: str) -> None:
        """`send`: the claim to the tables topic (the key's channel, which stamps the
        epoch at sending and keeps it through an outage)."""
        self.ownership = ownership
        self.send = send
        self.issued_by = issued_by
        self._claims: dict[TableKey, _Claim] = {}

    def serves(self, key: TableKey) -> bool:
        """Whether this replica acts for `key`: held, claimed, read up to its claim, and
        not claimed by a newer epoch since."""
        claim = self._claims.get(key)
        return (claim is not None and claim.read_back and not claim.superseded
                and self.ownership.tenure(key) == claim.tenure)

    def ended(self) -> list[TableKey]:
        """The keys whose tenure ended or changed since they were claimed: to stop serving
        now, before anything more of theirs is sent (`claim` takes them again if held)."""
        ended = [key for key, claim in self._claims.items()
                 if self.ownership.tenure(key) != claim.tenure]
        for key in ended:
            del self._claims[key]
        return ended

    def claim(self, known: Iterable[TableKey]) -> None:
        """Claim each of `known` this replica holds under a tenure not claimed yet."""
        for key in known:
            tenure = self.ownership.tenure(key)
            if tenure is None or key in self._claims:
                continue
            claim = TableControl(
                key=key, action="claim", version=None,
                issued_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
                control_id=new_control_id(), issued_by=self.issued_by,
                epoch=self.ownership.epoch)
            self._claims[key] = _Claim(tenure, claim.control_id)
            self.send(claim)

    def seen(self, control: TableControl) -> bool:
        """A claim on the tables topic; True when it takes `control.key` from this replica
        (a newer epoch's: stop serving it now)."""
        claim = self._claims.get(control.key)
        if claim is None or claim.superseded:
            return False
        if control.control_id == claim.control_id:
            claim.read_back = True
            return False
        if control.epoch > self.ownership.epoch:
            claim.superseded = True
            return True
        return False
