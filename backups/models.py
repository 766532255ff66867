"""No backup records yet: the backup document and schedule come with their own issue."""
