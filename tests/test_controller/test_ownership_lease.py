"""A control replica's lease: it sends only while the group says nothing is pending.

kafka-python counts a heartbeat answered "the group is rebalancing" as acknowledged (the
member's session stays alive) and flags a rejoin first. From that answer until the member
has rejoined, a newer generation may already have given its slots to another replica, so
the lease must not hold in between, however fresh the acknowledgement.
"""

from __future__ import annotations

import pytest

from controller.fleet.ownership import Ownership
from controller.fleet.ownership_config import OwnershipConfig
from schemas import TableKey
from schemas.settings import Settings
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.alone  # a replica's session outlives only short stalls

KEY = TableKey("m", "ngram", "cpu")


def test_a_pending_rebalance_suspends_the_lease_until_the_member_rejoins(
        topic_settings: Settings, unique_name: str) -> None:
    ownership = Ownership(topic_settings, OwnershipConfig(group_id=unique_name,
                                                          session_timeout_ms=3_000,
                                                          heartbeat_interval_ms=300))
    ownership.start()
    try:
        wait_for(lambda: ownership.slots or None, timeout_s=30)
        assert ownership.lease_holds()
        with ownership.holding(KEY) as epoch:
            assert epoch == ownership.epoch  # the only member owns every key

        # what kafka-python does with a heartbeat answered "rebalancing"
        ownership._consumer._coordinator.request_rejoin()
        assert not ownership.lease_holds()
        with ownership.holding(KEY) as epoch:
            assert epoch is None

        # the membership thread rejoins, and a send holds the lease again (read in one
        # `holding`: a loaded machine's late heartbeat answer can lapse it between two reads)
        def held() -> int | None:
            with ownership.holding(KEY) as epoch:
                return epoch if epoch is not None and epoch == ownership.epoch else None

        assert wait_for(held, timeout_s=30) == ownership.epoch
    finally:
        ownership.close()
