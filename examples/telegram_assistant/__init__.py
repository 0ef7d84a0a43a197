"""An assistant people talk to from Telegram."""
