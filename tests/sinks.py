"""A capturer sink for tests: keeps every record it is handed, in order."""

from r3rdma.records import RequestRecord


class ListSink:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def submit(self, record: RequestRecord) -> None:
        self.records.append(record)
