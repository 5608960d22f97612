"""Operations: the rmqtx CLI, status, reports and the demo."""
