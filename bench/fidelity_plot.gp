# Mass recall vs budget per selector, from kvsift_fidelity --plot-data. Usage:
#   gnuplot -e "data='mass.dat'; out='plot.png'" bench/fidelity_plot.gp
set terminal pngcairo size 720,480 font ",11"
set output out
set title "Attention-mass recall on real attention (SmolLM2-135M captures)"
set xlabel "budget (% of the context)"
set ylabel "mass recall"
set yrange [0:1]
set key bottom right
set grid
set datafile missing "NaN"
columns = system("head -1 " . data . " | wc -w")
plot for [c=2:columns] data using 1:c with linespoints lw 2 pt 7 title columnhead(c)
