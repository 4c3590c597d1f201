"""The words RULER's tasks are made of, without a download: RULER draws its keys (adjective-noun
pairs) and its common-word lists from the `wonderwords` package; these are plain English words
of our own choosing, enough for keys (ADJECTIVES x NOUNS: 11,439 pairs) and, with those pairs as
the rare words, for common-word lists at 128K tokens.

No word here is a substring of another single word (tests/evals/test_ruler_tasks.py checks), so
a common word found in an answer is that word, not part of a longer one.
"""

NOUNS = tuple("""
anchor apple acorn badge banjo barrel basket beacon bucket bunny cabin cactus camera candle
canyon carpet castle cellar cherry chimney circus closet cobra comet cookie copper cottage coyote
crayon dagger desert dolphin donkey dragon eagle easel falcon feather ferry fiddle forest fossil
fountain garage garlic geyser giraffe glacier goblet gravel guitar hammer harbor helmet hermit
hockey honey island jacket jelly jungle kettle kitten ladder lantern lemon lizard locket magnet
mango marble meadow mirror monkey mortar muffin napkin needle noodle oyster paddle palace parrot
peanut pebble pepper pillow pirate planet pocket potato puppet quilt rabbit radish ribbon rocket
saddle salmon shovel skillet sparrow spider statue summit sweater tablet teapot temple thimble
ticket tiger tomato trumpet tulip tunnel turtle valley violin wagon walrus wizard zebra
""".split())

ADJECTIVES = tuple("""
agile amber ancient brave breezy bright brisk bumpy calm chilly clever cloudy cozy crimson
crispy curly dainty daring dizzy dusty eager early fancy fierce fluffy frosty fuzzy gentle
giant gloomy golden graceful grumpy happy hasty hollow humble frozen jolly jumpy keen lively lofty
lucky lunar mellow mighty misty modest muddy narrow noble nimble odd orange pale patient plump
polite proud quick quiet rapid rosy rusty sandy scarlet shaggy shiny silent silky sleepy slim
smooth snowy solar sparkly spicy steady stormy sturdy sunny swift tame tidy timid tiny violet
vivid wacky wary windy witty
""".split())

VERBS = tuple("""
admire bake borrow bounce breathe build carry chase climb collect cheer crawl dance deliver dig
drift explore fetch float fold gather giggle glide grab greet hike hover hustle juggle kneel knit
launch laugh listen march mend nibble obey paint plant polish pour pray pull punch question
quiver read repair rescue roam scribble search shiver sing sketch skip slide sneeze sort sprint
stir stroll swim tickle travel tumble unpack visit wander whisper wiggle wobble yawn
""".split())

# Single words for common-word extraction: its answers must not contain one another.
SINGLE_WORDS = tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))
