"""A small English text, written for this project, that the synthetic tokenizers are trained on."""

CORPUS = """\
In winter the dormouse curls into a ball and sleeps for months. Its heart slows from hundreds of beats a
minute to only a few, and its body grows almost as cold as the burrow around it. This state is called
torpor. The animal is not dead and not quite asleep; it is waiting. When the days grow longer and the
ground warms, the dormouse wakes, stretches, and goes looking for food as if nothing had happened.

A bear does something similar, though less deeply. It can wake during the winter, and a mother bear even
gives birth in her den. Bats, hedgehogs and some hummingbirds enter torpor too. A hummingbird burns so much
energy that a cold night could kill it, so it lowers its temperature and waits for the sun. In the morning
it warms up again in a few minutes and flies off to the first flower of the day.

The idea of putting something to sleep and waking it later appears everywhere. A farmer stores seeds in a
dry, dark room; a year later they still grow. A cook freezes bread on Sunday and toasts it on Thursday. A
ship is laid up in a quiet harbour for the winter, its engines drained and its sails folded, and in spring
the crew returns, checks every rope, and sails away. Nothing is lost as long as everything was put away
with care, and everything is put back exactly where it was.

Computers sleep as well. A laptop closes its lid, writes the contents of its memory to the disk, and turns
off the power. When the lid opens, the memory is read back and the programs continue where they stopped.
The user sees the same windows, the same half-written letter, the same cursor blinking in the same place.
For this to work, every byte must come back to the address it came from. If one byte were missing or moved,
a program might crash, or worse, quietly give a wrong answer.

Large language models run on graphics processors with a limited amount of fast memory. The weights of a
model with eight billion parameters take about sixteen gigabytes. The cache of keys and values that lets
the model remember a conversation can take many more. When the processor is needed for something else,
such as training the next version of the model, the memory must be given back. The simple answer is to
stop the program and start it again later, but a restart can take a minute or more. A better answer is to
let the program sleep: copy what must be kept to the host, release the rest, and restore it on request.

Here is a short recipe for bread. Mix five hundred grams of flour with ten grams of salt, seven grams of
yeast and three hundred and fifty millilitres of warm water. Knead the dough for ten minutes until it is
smooth. Let it rise for one hour in a warm place, then shape it into a loaf. Bake it at two hundred and
twenty degrees for thirty five minutes. Let it cool before you cut it, or the inside will be sticky.

Questions and answers help people learn. What is the capital of France? Paris is the capital of France.
How many days are there in a week? There are seven days in a week. Why is the sky blue? Sunlight is
scattered by the air, and blue light is scattered more than red light. Which planet is closest to the sun?
Mercury is the closest planet to the sun. Can you count to ten? One, two, three, four, five, six, seven,
eight, nine, ten. Numbers can also be written with digits: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14.

A good assistant listens carefully, answers clearly, and says so when it does not know. It keeps its
answers short when a short answer is enough, and it explains the steps when the question is hard. It is
polite but not flattering. When asked to write a poem, it writes one; when asked to fix a bug, it reads
the code first. The user asked: "Please summarize the story in one sentence." The assistant replied:
"A small animal sleeps through the winter and wakes up in spring, unchanged."

The river runs past the old mill and under the stone bridge. Children throw sticks from one side and run
to the other to see whose stick comes out first. In the evening the light turns orange, the swallows fly
low over the water, and the baker closes the shop. Tomorrow the market opens early, and the town will be
full of voices, carts, apples, cheese, flowers and music. Everyone will be tired by noon and happy by night.

def greet(name):
    return "Hello, " + name + "!"

for i in range(3):
    print(greet("world"), i)

Some final words on patience. A tree does not grow in a day, a language is not learned in a week, and a
good program is rarely written on the first try. Test each piece, measure before you optimize, keep your
functions small, and write down why you made each choice. Then, when you come back after a long sleep of
your own, you will understand what you built and why it works.
"""
