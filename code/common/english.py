"""The project's own English text for the real-model runs (written for this repository; no downloads).

Three sets, kept apart:
  CALIBRATION  prose to fit things on (e.g. the codec's per-layer bins, its probability tables);
  EVALUATION   prose to measure on (perplexity, the codec's cross-entropy increase); never calibrated on;
  RAG_ITEMS    retrieval-style items: a question whose answer needs two passages, found in different
               chunks, plus distractor passages (CacheBlend's setting: the slides' Messi / Ronaldo
               example is the first item).
`rag_chunks(item, tok)` builds the real-model CacheBlend input: N_CHUNKS chunks of CHUNK_TOKENS tokens
each (the two key passages in two different chunks, distractors and filler prose around them) and the
question. The filler is the CALIBRATION prose, so EVALUATION stays untouched by every experiment.

Sizes with SmolLM2's tokenizer: `python -m common.english` from code/ prints them.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# ----------------------------------------------------------------------------------- prose
# Each paragraph is one topic in one style: instructions, encyclopedia, story, explanation,
# letter, history, news, popular science. Calibration and evaluation share no topic.

CALIBRATION = [
    # instructions
    """Good bread needs only four things: flour, water, salt and time. Mix five hundred grams of \
flour with three hundred and fifty grams of lukewarm water and leave the bowl covered for half an \
hour, so the flour can drink. Then add ten grams of salt and a spoonful of yeast, and knead the dough \
on a clean table for about ten minutes, folding it over itself and pressing it away with the heel of \
your hand. At first it will stick to everything; do not add more flour. After a while it becomes \
smooth and springs back when you press it with a finger. Put it back in the bowl and let it rise in \
a warm corner until it has doubled, which can take one hour in summer and three in winter. Shape it \
into a round loaf, let it rest once more, cut a shallow cross into the top and bake it in a very hot \
oven for forty minutes. Knock on the bottom: a hollow sound means the bread is done.""",
    # encyclopedia
    """A river delta forms where a river meets a slower body of water, such as a lake or the sea. \
As the current loses speed, it can no longer carry the sand and silt it has picked up along its \
course, and the sediment settles near the river mouth. Over centuries the deposits build new land, \
and the river splits into many smaller channels that wander across it. The Nile delta in Egypt has \
the classic triangular shape that gave the landform its name, after the Greek letter delta. Other \
deltas look like a bird's foot, with long fingers of land reaching into the sea, as the Mississippi \
delta does. Deltas are among the most fertile places on Earth, and many of them are crowded with \
farms and cities. They are also fragile. Dams upstream trap the sediment that once renewed them, and \
as the sea level rises, low deltas lose land to the water every year.""",
    # story
    """The six fifteen to the city was late again. Marta stood at the end of the platform, where the \
wind came off the fields, and watched the signal at the far bend stay red. Around her the usual \
people waited in their usual places: the man with the green umbrella who never opened it, the two \
nurses sharing a flask of coffee, the boy who read the same comic book every morning as if the ending \
might change. Nobody spoke. When the loudspeaker crackled, everyone looked up at once, like birds. \
"We apologise for the delay," said the recorded voice, and did not say why. Marta took out her phone, \
then put it away without reading anything. She had decided, somewhere between her front door and the \
station, that today she would tell her manager she was leaving. The signal turned green. Far away, \
two yellow lights appeared, and the rails began to hum.""",
    # technical explanation
    """A refrigerator does not make cold; it moves heat from the inside of the box to the room. The \
trick is a fluid that boils at a very low temperature. Inside the cabinet, the fluid flows through \
thin pipes at low pressure, where it evaporates and absorbs heat from the food and air around it, \
just as sweat cools your skin when it dries. A compressor then squeezes the warm vapour, which raises \
its pressure and temperature, and pushes it into the coils at the back of the appliance. There the \
vapour is hotter than the kitchen, so it gives its heat away and condenses back into a liquid. \
Finally the liquid passes through a narrow valve, its pressure drops, and the cycle starts again. \
This is why the back of a refrigerator feels warm, and why a kitchen gets slightly warmer, not \
cooler, if you leave the refrigerator door open.""",
    # letter
    """Dear Sam, the boxes are finally unpacked, apart from the one labelled "misc" that I suspect \
will stay closed until the next move. The new flat is smaller than the old one but it gets the \
morning sun, and from the kitchen window I can see a slice of the harbour between two warehouses. \
The neighbours are friendly in a quiet way. The woman downstairs left a plate of lemon biscuits on \
my doorstep on the first evening, with a note that said only "Welcome, the boiler makes noises, \
ignore them." She was right about the boiler. Work starts on Monday, and I am more nervous than I \
expected to be. I keep rehearsing conversations with people I have not met yet. Write and tell me \
how the garden is doing, and whether the apple tree gave anything this year. Come and visit when the \
weather turns; there is a sofa bed, and I know a place that makes excellent fish soup. Love, Jo""",
    # history
    """For most of history, sailors feared the coast more than the open sea. Rocks and sandbanks \
near the shore wrecked far more ships than storms in deep water, and so people began to mark \
dangerous places with fire. The most famous early lighthouse stood on the island of Pharos at \
Alexandria and was built in the third century before the common era; travellers described it as \
taller than any building they had seen. Medieval lighthouses were usually simple towers with a coal \
fire or candles at the top. The great change came in the nineteenth century, when the French \
engineer Augustin Fresnel designed a lens made of rings of glass prisms. It gathered the light of a \
single lamp into a beam that could be seen more than twenty miles away. Each lighthouse was given its \
own pattern of flashes, so that a captain at night could tell exactly which one he was looking at.""",
    # news
    """Riverside Rovers came from behind to beat Eastfield United two goals to one on Saturday, \
keeping their hopes of promotion alive with three matches left in the season. Eastfield took the \
lead after twelve minutes, when a long throw was flicked on at the near post and their captain headed \
it past the goalkeeper. The Rovers struggled to create chances in the first half, and their manager \
made two changes at the break. The move paid off. Ten minutes after the restart, the substitute \
winger cut inside from the left and curled a shot into the far corner. With the crowd on its feet, \
the Rovers kept pressing, and in the eighty-seventh minute a free kick from the edge of the area hit \
the wall, fell kindly, and was driven home by the centre back. "We showed character today," the \
manager said afterwards. "But we know the hardest games are still ahead of us.\"""",
    # popular science
    """Every animal that has a nervous system seems to sleep, from fruit flies to whales, and yet \
scientists still argue about exactly why. Sleep is a risky habit: a sleeping animal cannot look for \
food or watch for predators. So whatever sleep does, it must be important. One idea is that the brain \
uses the quiet hours to sort the day's experiences, strengthening useful memories and letting others \
fade. In experiments, people who sleep after learning a list of words remember more of them the next \
day than people who stay awake. Another idea is cleaning. During deep sleep, the fluid around the \
brain cells flows more freely and washes away waste products that build up during waking hours. Both \
ideas may be true at once. What is certain is that missing sleep has a price. After one bad night, \
attention slips, tempers shorten, and simple mistakes become more common.""",
    # encyclopedia
    """A volcano is an opening in the Earth's crust through which molten rock, gas and ash escape \
from below. Deep underground, where the rock is hot enough to melt, the melted rock collects in \
chambers, and because it is lighter than the solid rock around it, it slowly pushes upwards. When the \
pressure becomes too great, it breaks through the surface. Some volcanoes erupt quietly, with rivers \
of runny lava that flow for miles, as they do in Hawaii. Others explode. Their magma is thick and \
sticky, it traps gas like the bubbles in a shaken bottle, and when it finally gives way it can throw \
ash high into the sky. In the year seventy nine, an eruption of Vesuvius buried the Roman towns of \
Pompeii and Herculaneum. Today scientists watch active volcanoes closely, measuring small earthquakes, \
changes in the shape of the ground and the gases that leak from cracks.""",
    # dialogue
    """"So, tell me why you want to work here," said the woman behind the desk, folding her hands. \
Daniel had prepared an answer to exactly this question, and now he could not remember a word of it. \
"Honestly?" he said. "Because I walked past your shop every day for two years on my way to school, \
and it was the only place in the street that always had the lights on." She raised an eyebrow. "That \
is not the answer most people give." "What do most people give?" "They talk about passion and \
teamwork." He smiled. "I can do that too, if you like." For the first time she laughed. "No, keep \
going. What would you change, if you worked here?" He looked around at the crowded shelves, the \
handwritten price cards, the cat asleep on a pile of atlases. "Nothing at first," he said. "I would \
want to understand why it works before I touched anything.\"""",
    # instructions
    """To fix a flat bicycle tyre, first remove the wheel. Open the brake if it is in the way, \
loosen the nuts or the quick release lever, and lift the wheel out of the frame. Push two tyre \
levers under the edge of the tyre, a hand's width apart, and pull the edge over the rim; then run one \
lever around the wheel until one side of the tyre is free. Pull out the inner tube. Pump a little air \
into it and listen, or hold it near your cheek, to find the hole. Before you put in a new tube or a \
patch, run your fingers carefully around the inside of the tyre, because the thorn or the piece of \
glass that caused the puncture is often still there. Put the tube back with a little air in it, so it \
does not twist, press the tyre back onto the rim with your thumbs, and pump it up to the pressure \
printed on its side.""",
    # nature
    """The Arctic tern weighs about as much as a bar of soap, yet it makes the longest journey of any \
animal on Earth. Every year it flies from its breeding grounds near the North Pole to the edge of the \
ice around Antarctica and back again. Birds fitted with tiny tracking devices have shown that the \
route is not a straight line. The terns follow a wide curve across the Atlantic, riding the winds \
that blow around the ocean, and they stop to feed in places where cold water brings fish close to the \
surface. Over a lifetime of thirty years, one bird may travel a distance equal to three trips to the \
Moon and back. Because it moves between two polar summers, the Arctic tern probably sees more \
daylight than any other creature. It pays for this with a life spent almost always on the wing.""",
    # history
    """The first coffee houses in London opened in the sixteen fifties, and within a few decades there \
were hundreds of them. For the price of a single cup, anyone could come in, sit at the long tables, \
read the newspapers and join the conversation, which is why people called them penny universities. \
Different houses attracted different crowds. Merchants and ship owners met at one to hear news of \
cargoes and storms; scientists gathered at another to argue about experiments; writers and poets had \
their own. Some of these meetings grew into lasting institutions. A coffee house run by a man named \
Edward Lloyd, where people came to insure ships, became one of the most famous insurance markets in \
the world. The government was nervous about all this free talk, and the king once tried to close the \
coffee houses altogether, but the order was withdrawn within days.""",
    # notice
    """Notice to all residents of Linden Court. The water supply to the building will be turned off \
on Thursday between nine in the morning and three in the afternoon, while the old pipes in the \
basement are replaced. Please fill a few bottles or a bath on Wednesday evening if you will need \
water during the day. The lifts will work as usual, but the laundry room will be closed until Friday \
morning. Contractors will need to enter flats on the ground floor to check the stop valves under the \
kitchen sinks; if you live on the ground floor and will not be at home, please leave a key with the \
caretaker or contact the management office before Tuesday. We are sorry for the inconvenience. The \
new pipes should put an end to the low pressure and the rusty water that many of you have reported \
over the past year.""",
    # memoir
    """My grandmother's kitchen was the warmest room I have ever known, and not only because of the \
stove. She cooked without recipes and without measuring, adding flour until the dough "felt right" \
and salt until the soup "tasted like soup". When I asked her how long to boil something, she would \
say, "Until it is ready," as if the question made no sense. There was always a radio on the \
windowsill, always tuned to the same station, playing old songs that she hummed half a beat behind. \
On Sundays the whole family crowded around her table, and the conversation was so loud that the \
neighbours complained. After she died, my mother tried to write down her dishes. We cooked them again \
and again, weighing everything, and they were good. But they were never quite the same, and we all \
knew, without saying it, which ingredient was missing.""",
    # technical explanation
    """A phone finds its position with the help of about thirty satellites that circle the Earth \
twice a day. Each satellite carries a very precise clock and continuously broadcasts the time and its \
own position. Radio waves travel at the speed of light, so when the phone receives a signal, it can \
work out how long the signal took to arrive, and therefore how far away the satellite is. One distance \
places the phone somewhere on the surface of a huge sphere. Distances to three satellites narrow this \
down to a single point, and a fourth satellite lets the phone correct the error of its own cheap \
clock. The timing has to be astonishingly exact: an error of one millionth of a second would move the \
answer by three hundred metres. The system even corrects for Einstein's relativity, because clocks in \
orbit run slightly faster than clocks on the ground.""",
    # opinion
    """Our town should build proper cycle lanes on the main road, and it should do it this year. At \
the moment, anyone who cycles to the station has to share a narrow lane with buses and delivery vans, \
and most parents, sensibly, will not let their children try. The usual objection is that cycle lanes \
take space from cars and hurt the shops. The evidence from other towns suggests the opposite. People \
on bicycles stop more often, spend a little each time, and come back more often than drivers who \
must find somewhere to park. A separated lane costs less than one new car park, and it would ease \
traffic for everyone who still needs to drive. Nobody is asking drivers to give up their cars. We are \
asking the council to make the safe choice the easy one, for the many people who would gladly leave \
the car at home.""",
    # encyclopedia
    """Twice a day, on most coasts, the sea rises and falls. These tides are caused mainly by the \
Moon. Its gravity pulls hardest on the side of the Earth that faces it, so the ocean there bulges \
slightly towards the Moon. On the opposite side of the planet a second bulge forms, because there the \
Moon pulls least of all, and the water is in effect left behind. As the Earth turns, every coast \
passes through both bulges each day, which gives two high tides and two low tides. The Sun adds its \
own smaller pull. When Sun and Moon line up, at new moon and full moon, the tides are strongest and \
are called spring tides, a name that has nothing to do with the season. When they pull at right \
angles, the difference between high and low water is smallest. The shape of the coast matters too: in \
some narrow bays the water rises by more than fifteen metres.""",
    # fable
    """A crow found a piece of cheese on a windowsill and flew with it to the top of a tall tree. A \
fox, passing below, smelled the cheese and sat down at the foot of the trunk. "What a beautiful bird," \
he said loudly, to nobody in particular. "Such shining feathers, such a graceful neck. It is a pity \
that a bird so fine has no voice at all, or she would surely be queen of all the birds." The crow, who \
had never been praised in her life, wanted very much to prove him wrong. She opened her beak to sing, \
and the cheese dropped straight into the fox's mouth. He swallowed it, licked his lips and stood up. \
"You have a voice, madam," he said as he trotted away, "but you could use a little more sense." The \
old storytellers ended with a warning: be careful of anyone who praises you while looking at your \
cheese.""",
]

EVALUATION = [
    # science
    """A vaccine teaches the immune system to recognise an enemy before the real enemy arrives. It \
contains a harmless piece or copy of a virus or bacterium, often a single protein from its surface, \
or instructions that let our own cells make that protein for a short time. The immune system cannot \
tell that the visitor is harmless, so it responds as it would to an infection. Certain white blood \
cells produce antibodies that fit the foreign protein like a key in a lock, and others learn to \
destroy infected cells. When the response is over, a small number of memory cells remain in the body \
for years. If the real germ appears later, these cells recognise it at once and the defence starts \
within hours instead of days. That head start is often enough to stop the illness completely or to \
keep it mild.""",
    # description
    """On market day the square fills before the church bell has finished striking seven. Farmers \
back their vans into the same places their parents used, and within an hour the stalls are stacked \
with potatoes still dusty from the field, bunches of carrots with their leaves on, jars of honey and \
wheels of pale cheese. The fishmonger arrives last and shouts loudest. By nine the older residents \
are doing their rounds with wheeled baskets, stopping to argue about prices and the weather, and the \
cafe on the corner has put every one of its tables outside. Children are given a coin to spend on \
strawberries. Around noon the crowd thins, the sellers begin to pack away what is left, and by two \
o'clock the only sign that the market was there at all is a few crushed leaves and a pigeon looking \
hopefully at the cobbles.""",
    # instructions / description
    """A beehive in high summer can hold fifty thousand bees, and almost all of them are female \
workers. A worker's job changes as she ages. In her first days she cleans the cells of the comb; then \
she feeds the larvae, builds new wax and guards the entrance. Only in the last weeks of her short \
life does she fly out to gather nectar and pollen. Beekeepers learn to move slowly around the hive. \
They open it on warm, calm days, when most foragers are out, and they use a little smoke, which makes \
the bees eat honey and become less likely to sting. To check the health of a colony, the keeper lifts \
out the frames one by one and looks for eggs, which show that the queen is alive and laying. A frame \
heavy with capped honey is a good sign that the colony will survive the winter.""",
    # history
    """Before the printing press, every book in Europe was copied by hand, and a single Bible could \
take a scribe more than a year. Around 1450, in the German city of Mainz, Johannes Gutenberg combined \
several existing ideas into a system that changed this. He cast individual letters in metal, so that \
they could be arranged into lines, printed, and then taken apart and used again. He adapted the screw \
press that wine makers used to squeeze grapes, and he developed an oil based ink that stuck to metal \
better than the water based inks of the time. Within fifty years, printing shops had opened in more \
than two hundred cities, and millions of books were in circulation. Prices fell, more people learned \
to read, and ideas travelled faster than any ruler could control them.""",
    # story
    """By midnight the wind had turned, and the small boat began to climb waves that came out of the \
dark like moving hills. Elena held the tiller with both hands while her brother tied down everything \
that could slide. Neither of them said what they were both thinking: that they should have stayed in \
the harbour when the fisherman at the fuel dock shook his head at the sky. Spray hit them sideways and \
ran down inside their collars. Somewhere below, a pan fell and rolled back and forth with each wave. \
"The lighthouse," her brother shouted suddenly, and pointed. Through the rain she saw it, a short \
white flash, then darkness, then the flash again. She counted the seconds between them and knew \
where they were. She pushed the tiller away from her, and slowly, stubbornly, the bow came round \
towards the light.""",
    # economics explained
    """Compound interest is interest earned on interest. Suppose you put one thousand pounds in an \
account that pays five percent a year. After the first year you have one thousand and fifty pounds. \
In the second year, the bank pays five percent on the whole amount, not only on the original deposit, \
so you earn fifty two pounds and fifty pence instead of fifty. The difference looks tiny at first, \
but it grows every year, because each year's interest becomes part of the amount that earns interest \
the next. After ten years the account holds about one thousand six hundred and twenty nine pounds; \
after thirty years, more than four thousand three hundred. A useful shortcut is the rule of seventy \
two: divide seventy two by the interest rate, and you get roughly the number of years it takes for \
money to double. The same arithmetic works against you when you borrow.""",
    # news
    """The city council voted on Tuesday evening to keep the Northgate branch library open, reversing \
a plan announced in the spring to close it at the end of the year. More than three hundred residents \
attended the meeting, filling the chamber and the corridor outside, and forty of them spoke during \
the public comment period. Speakers included a retired teacher who has volunteered at the library's \
reading club for twenty years, and a student who said the building was the only quiet place she had \
to study. The council will pay for the branch by delaying the repaving of two car parks. The branch \
will, however, reduce its opening hours on Mondays. The mayor said she was moved by the turnout. \
"People told us clearly what they value," she said, "and we listened.\"""",
    # science
    """The water in a glass on your table may once have fallen as rain on a mountain, flowed to the \
sea, and risen again into the sky. This endless journey is called the water cycle, and the sun \
drives it. Sunlight warms the surface of oceans, lakes and rivers, and some of the water evaporates \
into invisible vapour. Plants add more, releasing water through tiny pores in their leaves. As the \
warm, moist air rises, it cools, and the vapour condenses into droplets around specks of dust, \
forming clouds. When the droplets grow heavy enough, they fall as rain, snow or hail. Some of that \
water runs off the land into streams, some soaks into the ground and fills underground layers of rock \
and gravel, and some is locked away for centuries in glaciers. Sooner or later, almost all of it \
returns to the sea.""",
    # essay, first person
    """I lost the game in the twenty-third move, although it took another fifteen moves for me to \
notice. My opponent, a quiet man in a grey cardigan, had offered me a pawn, and I took it because it \
was free. Nothing in chess is free. By taking the pawn I moved my knight away from the centre, and \
from that moment his pieces had more room than mine. Looking back at the score sheet on the bus home, \
I could see the whole story: each of his moves was small and patient, and each of mine was a little \
greedy. What strikes me is how reasonable every one of my decisions felt at the time. That is \
probably the most useful thing the game has taught me, at the board and away from it: the mistakes \
that cost the most rarely look like mistakes when you make them.""",
    # review
    """The orchestra opened its autumn season on Friday with a programme that moved from the \
familiar to the strange, and the audience followed it happily all the way. The first half belonged \
to Beethoven. The young conductor took the Seventh Symphony at a brisk pace, and in the famous slow \
movement she let the violas and cellos carry the melody with a warmth that made the hall go still. \
After the interval came a new piece for strings and percussion by a local composer, full of \
scratching bows, whispered chords and sudden silences. A few listeners looked puzzled at first, but \
by the end the applause was loud and long, and the composer, called up onto the stage, bowed \
awkwardly in her trainers. The concert will be repeated on Sunday afternoon, and tickets are still \
available.""",
    # science
    """Sound is a wave of pressure that travels through air, water or solid matter. When a guitar \
string vibrates, it pushes the nearby air molecules together and then lets them spread apart, many \
hundreds of times each second. Each squeeze passes to the next layer of air, so the disturbance moves \
outward while the air itself stays more or less where it was. In air at room temperature the wave \
covers about three hundred and forty metres every second, which is why the thunder of a distant storm \
arrives several seconds after the flash. In water sound travels more than four times faster, and in \
steel faster still, because the particles are packed closely and push on one another quickly. The \
number of vibrations per second sets the pitch we hear, and the size of each squeeze sets the \
loudness.""",
    # how-to
    """Repairing a puncture on a bicycle takes about twenty minutes once you have done it twice. \
Start by removing the wheel and letting out whatever air is left in the tube. Slide a tyre lever \
under the edge of the tyre, hook it onto a spoke, and run a second lever around the rim until one \
side of the tyre comes free. Pull out the tube, pump a little air into it and listen, or pass it \
slowly near your cheek, to find the hole. Before you fix anything, run your fingers carefully around \
the inside of the tyre, because a small thorn or piece of glass left there will cause the next \
puncture within a mile. Roughen the area around the hole with sandpaper, spread a thin layer of glue, \
wait until it turns dull, and press the patch on firmly. Refit the tube and tyre, and inflate slowly.""",
    # history
    """For most of human history, the time of day was a local matter. Each town set its clocks by the \
sun, so noon in a city to the west came a few minutes later than noon in a city to the east. Nobody \
minded while travel was slow, but the railways changed that. A train timetable that listed dozens of \
stations, each keeping its own time, was confusing for passengers and dangerous for drivers sharing a \
single track. Railway companies began to run all their trains on one standard time, usually that of \
their main city, and station clocks sometimes showed two faces, local and railway. Over the following \
decades countries adopted national standard times, and in the end the world was divided into time \
zones, most of them one hour wide. The change was practical, not scientific, and a few places still \
keep unusual offsets today.""",
    # story
    """The lighthouse keeper had lived alone on the island for eleven years when the letter arrived. \
It came with the monthly supply boat, tucked between a box of candles and a sack of flour, and it was \
addressed in a handwriting he had not seen since he was a young man. He did not open it at once. He \
carried the supplies up the steep path, lit the stove, made tea, and only then sat down at the table \
by the window with the envelope in front of him. Outside, the gulls were arguing over something on \
the rocks and the sea was the colour of slate. He turned the letter over twice. Then he remembered \
the lamp had to be checked before dark, and he put the letter on the shelf beside the clock, where \
it stayed, unopened, for another three days.""",
    # explanation
    """A bank does not keep most of the money that people deposit with it in a vault. It keeps a \
fraction in reserve, enough to pay the customers who want cash on an ordinary day, and lends the rest \
to households and businesses that want to buy a house, build a factory or pay wages before their own \
customers have paid them. The borrowers pay interest, and part of that interest becomes the small \
return the bank pays its depositors. This arrangement works because, on most days, only a few \
depositors ask for their money back at once. If many people fear that a bank is in trouble and all \
try to withdraw at the same time, even a healthy bank cannot pay them all immediately. That is why \
governments insure deposits up to a limit and central banks stand ready to lend in a crisis.""",
    # nature
    """Early on a spring morning the wood is louder than most people expect. Before the sun is up, a \
single robin begins, and within a few minutes wrens, blackbirds and thrushes have joined in, each \
repeating its own phrases from a favourite branch. The males are singing to claim a patch of ground \
and to attract a mate, and they sing hardest at dawn, when the air is still and sound carries \
furthest, and when it is still too dark to search for insects. As the light grows the chorus thins \
out. The birds drop to the ground to feed, the wind picks up in the tops of the trees, and the first \
dog walkers appear on the path. By the time most of the town is having breakfast, the wood sounds \
quiet and ordinary again, and few of them ever know what they missed.""",
]


# ----------------------------------------------------------------------------------- RAG items
@dataclass(frozen=True)
class RagItem:
    """A question whose answer needs both key passages; the distractors look relevant but are not."""
    question: str
    answer: str                  # a short reference answer (for reading the greedy output)
    key_passages: tuple[str, str]
    distractors: tuple[str, ...]


RAG_ITEMS = [
    RagItem(  # the slides' example (goals at men's World Cup finals tournaments, as of the 2022 tournament)
        question="Who scored more goals at World Cups, Lionel Messi or Cristiano Ronaldo, and by how many?",
        answer="Lionel Messi, by 5 goals (13 against 8).",
        key_passages=(
            "Lionel Messi has played in five World Cups for Argentina. Across those tournaments he "
            "scored 13 goals, and he won the trophy in Qatar in 2022.",
            "Cristiano Ronaldo has also played in five World Cups, for Portugal. He scored 8 goals at "
            "the tournament and became the first man to score at five different World Cups."),
        distractors=(
            "Miroslav Klose of Germany holds the record for the most goals at World Cups. He played "
            "in four tournaments between 2002 and 2014.",
            "The 2022 World Cup final was played at the Lusail Stadium, in front of almost ninety "
            "thousand spectators, and was decided by a penalty shoot-out.")),
    RagItem(
        question="Which lake is deeper, Lake Varna or Lake Osric, and by how many metres?",
        answer="Lake Varna, by 65 metres (212 against 147).",
        key_passages=(
            "Lake Varna lies in a narrow valley carved by glaciers. Its deepest point, near the "
            "northern cliffs, is 212 metres below the surface.",
            "Lake Osric is wide and popular with sailors. Surveys with sonar have measured its "
            "greatest depth at 147 metres."),
        distractors=(
            "Lake Tellin is famous for its trout and for the old stone boathouse on its eastern shore.",
            "The valley that holds Lake Varna is also home to three small villages and a ski lift "
            "that runs in winter.")),
    RagItem(
        question="Which river flows through the city where Dr. Amira Solberg was born?",
        answer="The River Tamsin (she was born in Keldmouth).",
        key_passages=(
            "Dr. Amira Solberg, the marine biologist who mapped the cold-water reefs of the north, "
            "was born in the port city of Keldmouth.",
            "Keldmouth grew up where the River Tamsin meets the sea. The river runs through the "
            "middle of the old town, crossed by seven bridges."),
        distractors=(
            "Dr. Solberg later taught at the university in Harlow, where she founded a laboratory "
            "for the study of deep-sea corals.",
            "The River Orne flows through Harlow and is known for its slow, muddy current.")),
    RagItem(
        question="Which bridge is older, the Old Mill Bridge or the Harrow Street Bridge, and by how many years?",
        answer="The Old Mill Bridge, by 35 years (1868 against 1903).",
        key_passages=(
            "The Old Mill Bridge in Brenford was opened in 1868. It was built of local stone to carry "
            "carts of grain to the mill.",
            "The Harrow Street Bridge was opened in 1903, one of the first bridges in the region "
            "made of steel."),
        distractors=(
            "The Queen's Footbridge in Brenford is the newest crossing of the river and is closed "
            "to bicycles.",
            "Brenford's mill stopped working long ago; today the building is a museum of "
            "farming tools.")),
    RagItem(
        question="How many loaves did the Copperleaf Bakery sell over the whole weekend?",
        answer="425 loaves (240 on Saturday and 185 on Sunday).",
        key_passages=(
            "On Saturday the Copperleaf Bakery sold 240 loaves of bread, most of them before noon.",
            "On Sunday, when the market was closed, the Copperleaf Bakery sold 185 loaves."),
        distractors=(
            "The Copperleaf Bakery also sells cakes, and its carrot cake won a prize at the county "
            "show.",
            "The bakery across the square, Miller and Sons, opens only on weekdays.")),
    RagItem(
        question="In which village was the violin of Tomas Reyk made?",
        answer="Ostervik (the workshop of Ilse Brandt).",
        key_passages=(
            "The violinist Tomas Reyk plays an instrument made in the workshop of Ilse Brandt, which "
            "he bought when he was nineteen.",
            "Ilse Brandt's workshop is in the small village of Ostervik, on the coast of Norway, "
            "where she has built violins for forty years."),
        distractors=(
            "Tomas Reyk studied music in Vienna and now lives in Copenhagen with his family.",
            "The village of Haldersund is known for its boat builders and its summer music festival.")),
    RagItem(
        question="Who won the Redwater Marathon, Naomi Kiprop or Lena Hart, and by how many minutes?",
        answer="Naomi Kiprop, by 5 minutes (2:21 against 2:26).",
        key_passages=(
            "Naomi Kiprop ran the Redwater Marathon in 2 hours and 21 minutes, in cold and windy "
            "weather.",
            "Lena Hart crossed the finish line of the Redwater Marathon in 2 hours and 26 minutes."),
        distractors=(
            "The Redwater Marathon starts by the harbour and finishes in front of the town hall.",
            "Last year's winner did not take part, because of an injury to her knee.")),
    RagItem(  # heights from the 2020 survey (Everest) and the commonly cited figure (K2)
        question="How much higher is Mount Everest than K2, in metres?",
        answer="238 metres (8849 against 8611).",
        key_passages=(
            "A survey in 2020 measured the height of Mount Everest, on the border of Nepal and "
            "China, as 8849 metres.",
            "K2, in the Karakoram range, is the second highest mountain on Earth, at 8611 metres."),
        distractors=(
            "Kangchenjunga is the third highest mountain in the world and lies on the border of "
            "Nepal and India.",
            "The first people to reach the summit of Mount Everest did so in 1953.")),
]


# ----------------------------------------------------------------------------------- CacheBlend input
N_CHUNKS = 6          # the real-model CacheBlend run: 6 retrieved chunks ...
CHUNK_TOKENS = 512    # ... of 512 tokens each ...
KEY_CHUNKS = (1, 4)   # ... the two key passages in chunks 1 and 4, so the answer needs cross-chunk attention


# SmolLM2-Instruct's chat format (ChatML, from the GGUF's chat template). With a plain
# "Question: ...\nAnswer:" the instruct model ends its turn at once (<|im_end|>); inside a user turn
# it answers from the passages. The prefix opens the user turn before chunk 0, the question closes it.
CHAT_PREFIX = "<|im_start|>user\n"


def question_text(item: RagItem, chat: bool = True) -> str:
    """The question as it follows the chunks; the answer's first token is predicted after it."""
    if chat:
        return f"Question: {item.question}<|im_end|>\n<|im_start|>assistant\n"
    return f"Question: {item.question}\nAnswer:"


@dataclass
class RagInput:
    prefix: list[int]         # tokens before chunk 0 (the chat prefix; [] without chat)
    chunks: list[list[int]]   # N token lists of exactly chunk_tokens tokens, each tokenized alone
    question: list[int]       # the question's tokens (about 25-40)
    texts: list[str]          # the chunks' text before cutting to chunk_tokens
    key_chunks: tuple[int, int]
    item: RagItem


def rag_chunks(item: RagItem, tok, n_chunks: int = N_CHUNKS, chunk_tokens: int = CHUNK_TOKENS,
               key_chunks: tuple[int, int] = KEY_CHUNKS, seed: int = 0, chat: bool = True) -> RagInput:
    """Retrieval-style input for `item`: prefix, n_chunks chunks of chunk_tokens tokens each, question.

    Chunk key_chunks[0] opens with the first key passage, chunk key_chunks[1] with the second; the
    item's distractors open two other chunks; every chunk is then filled with CALIBRATION prose
    (shuffled by `seed`) and cut to exactly chunk_tokens tokens. No filler paragraph repeats at the
    default sizes (the calibration prose is ~3400 tokens); much longer inputs would reuse it. Each chunk is
    tokenized alone, as CacheBlend precomputes each chunk's KV alone. `tok` is a tokenizers.Tokenizer. The model's input
    is prefix + chunks[0] + ... + chunks[-1] + question.
    """
    if n_chunks < 2 or len(set(key_chunks)) != 2 or not all(0 <= k < n_chunks for k in key_chunks):
        raise ValueError(f"key_chunks {key_chunks} must be two different chunks of {n_chunks}")
    rng = random.Random(seed)
    filler = CALIBRATION[:]
    rng.shuffle(filler)
    openers = [[] for _ in range(n_chunks)]
    openers[key_chunks[0]].append(item.key_passages[0])
    openers[key_chunks[1]].append(item.key_passages[1])
    others = [i for i in range(n_chunks) if i not in key_chunks]
    for j, d in enumerate(item.distractors):
        openers[others[j % len(others)] if others else key_chunks[j % 2]].append(d)

    chunks, texts, f = [], [], 0
    for i in range(n_chunks):
        parts = list(openers[i])
        while True:  # add filler paragraphs until the chunk is long enough
            text = "\n\n".join(parts) + "\n\n"
            ids = tok.encode(text).ids
            if len(ids) >= chunk_tokens:
                break
            parts.append(filler[f % len(filler)])
            f += 1
        chunks.append(ids[:chunk_tokens])
        texts.append(text)
    prefix = tok.encode(CHAT_PREFIX).ids if chat else []
    return RagInput(prefix, chunks, tok.encode(question_text(item, chat)).ids, texts, tuple(key_chunks), item)


def _main():
    """cd code && python -m common.english: token counts with SmolLM2's tokenizer."""
    from .gguf_llama import load_gguf_llama, smollm2_or_explain

    if smollm2_or_explain() is None:
        return
    _, tok, _ = load_gguf_llama()
    n = lambda texts: sum(len(tok.encode(t).ids) for t in texts)  # noqa: E731
    print(f"calibration: {len(CALIBRATION)} paragraphs, {n(CALIBRATION)} tokens")
    print(f"evaluation:  {len(EVALUATION)} paragraphs, {n(EVALUATION)} tokens")
    rag = [p for it in RAG_ITEMS for p in it.key_passages + it.distractors]
    print(f"RAG items:   {len(RAG_ITEMS)} items, {len(rag)} passages, {n(rag)} tokens")
    for it in RAG_ITEMS:
        r = rag_chunks(it, tok)
        print(f"  {len(r.prefix)} + {len(r.chunks)} x {len(r.chunks[0])} + {len(r.question):2d} question tokens: "
              f"{it.question}")


if __name__ == "__main__":
    _main()
