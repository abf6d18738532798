"""The fleet side of control: the control service that `tabletune control` runs.

`runner` feeds `service.ControlService` from Kafka; the service keeps one `loop.ClosedLoop` per
table key; the loop's decisions reach engines through a `channel` (the tables topic, or the
twin's engines in memory); `table_log` writes and reads the tables topic for operators and jobs.
"""
