"""A short held-out text (written for these tests, in no training set) for quality checks."""

HELDOUT_TEXT = (
    "The lighthouse keeper kept two notebooks. In the first he wrote the weather every four hours: "
    "wind from the north-west, a falling barometer, rain arriving just after the evening lamp was lit. "
    "In the second he wrote down the ships he saw, their colours and the direction they sailed, and "
    "once a small boat with a red sail that circled the rocks twice before turning back to the harbour. "
    "When the inspector came in the spring, he read the first notebook carefully and did not open the "
    "second, which the keeper thought was a pity, because the second was the one that explained why "
    "the lamp had been lit early on so many winter afternoons."
)
