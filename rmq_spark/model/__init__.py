"""The ground floor: messages and their validation, errors, settings, table schemas."""
