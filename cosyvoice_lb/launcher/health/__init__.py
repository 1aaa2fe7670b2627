"""The health loop: probe every instance, judge it, act; the rotation and elastic scaling."""
