"""The serving app keeps no tables yet; usage records arrive with metering."""
